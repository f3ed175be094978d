"""The device core: one device's side of a round as inputs -> outcomes, what it accepts from the
server, its uploads and their sealing, its emulated profile; no transport inside."""
