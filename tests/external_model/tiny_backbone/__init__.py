"""A backbone brought from outside protofl-edge (a test fixture); see nets.make."""
