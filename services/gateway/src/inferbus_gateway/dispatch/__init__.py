"""Getting a request to a worker and its answer back: the bus dispatcher, the
CPU load that sizes its bundle window, idempotent replays and lazy loads."""
