"""The models one server serves: the registry routes resolve a request's model in, their loading and
validation, and reloading them from disk without dropping a request (SIGHUP, POST /admin/reload,
--watch)."""
