"""What a run reports: logs, metrics.jsonl, throughput and MFU, the tracker and profiles."""
