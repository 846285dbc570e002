"""The worker task: runs step closures sent by the coordinator (see psworker.worker)."""
