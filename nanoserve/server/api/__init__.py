"""HTTP routes: thin translations between request schemas and `Engine.generate`."""
