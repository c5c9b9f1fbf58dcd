"""OpenAI's API under `/v1`: routes, schemas, and the formatting of its responses."""
