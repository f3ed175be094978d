"""The fleet: one long-running server, its broker and credentials, serving a queue of runs one after
another (`protofl-server fleet`, `protofl-server run ...`)."""
