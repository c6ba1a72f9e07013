"""The foundation every role shares: wire and messages, errors, logging, metrics, advantages, the tiny
model, dtypes, model lookup (hub, gguf) and the config sections actors and learners share. It imports
no role and no command (docs/design.md, "Layers")."""
