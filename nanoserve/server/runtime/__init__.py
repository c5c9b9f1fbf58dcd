"""Process settings the server makes for itself: the GIL switch interval and the heap."""
