"""On-disk kuat datasets: Arrow IPC shards and a JSON manifest."""
