"""The command lines of `protofl-server` beyond the root app (broker_server/cli.py): each maps its
options onto the settings bundles (broker_server/settings.py) the services take."""
