"""Training configuration: the TOML file and its --section.key=value flags, each key's range, the
checks of a whole config, and ModelArgs built from settings or a saved run."""
