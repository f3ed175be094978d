"""Scale-out: aggregator shards and the coordinator that merges their partials, site brokers bridged
to the core and their pre-aggregators (docs/design.md, "Scale-out")."""
