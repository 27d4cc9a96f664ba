"""What dynamo says and what autoweave reports: counting, graph-break places, the plan summary, the trace, the report."""
