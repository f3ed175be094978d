"""The aggregator core: the round state machine, the server model and its open phase, the I/O shell,
the durable state (journal, checkpoint, restart) and who takes part; numpy only, over any transport."""
