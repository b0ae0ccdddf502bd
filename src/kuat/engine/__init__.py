"""Workers (threads or processes), bounded queues, ordering, error transport, shutdown."""
