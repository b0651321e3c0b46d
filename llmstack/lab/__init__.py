"""The lab's experiments as tools: single-request latency, memory, preemption (the KV planner is llmstack.kv)."""
