"""Device operations: the device loop over MQTT and the simulator's carrier, local checkpoints and data,
`protofl-edge doctor`, model sizes and footprints, log shipping."""
