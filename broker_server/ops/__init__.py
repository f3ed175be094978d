"""Broker operations: the broker the server runs, its credentials, certificates and ACL, enrolment,
the devices' logs, supervision, capacity and re-sends after the broker drops."""
