"""The serving engine: KV pool, scheduler and executors (torch and simulated)."""
