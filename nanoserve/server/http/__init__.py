"""Below and around the routes: the HTTP protocol, connection and request guards, API keys,
the access log, HEAD, and errors in each API's dialect."""
