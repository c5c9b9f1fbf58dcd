"""From engine events to bytes on the wire: SSE, generation glue, merged streams, encoding."""
