"""Training configuration. It reads the TOML file and the --section.key=value flags. It checks
each key's range and then the whole config. It builds ModelArgs from settings or a saved run."""
