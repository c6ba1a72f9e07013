"""The commands: `distrl <command>` parses and composes the config (cli, config, configfile), checks it
(preflight), then assembles and runs the roles (trainer, launch, replay, evaluate) and reports (console,
report, faults, placement). May import every layer (docs/design.md, "Layers")."""
