"""OpenAI-compatible HTTP front door: /v1/completions and /v1/models over RouterService.Generate."""
