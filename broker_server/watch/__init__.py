"""Watching a running federation: what `protofl-server status`, `/metrics` and the live page show.

`snapshot` (the immutable view and its JSON, the monitor protocol), `observer` (builds snapshots from
the aggregator, on the service thread only), `board` (hands the latest one to other threads), `live`
(the service thread's cadence: board, status.json, the retained `server/summary`), `metrics` (the
Prometheus endpoint), `ui` (the live page), `sources` + `render` + `status_cli` (`protofl-server
status`), `monitor` (the read-only monitor credential). numpy only.
"""
