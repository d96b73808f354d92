"""OpenAI-compatible serving: scheduler, HTTP app, metrics."""
