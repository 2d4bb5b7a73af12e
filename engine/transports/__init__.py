"""Transport backends (imported lazily through engine.transport.create_transport)."""
