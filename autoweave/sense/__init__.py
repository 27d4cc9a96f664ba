"""What the machine senses of dynamo and of the model, below the hot path that acts on it."""
