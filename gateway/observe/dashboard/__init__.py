"""The built-in dashboard: static pages served by the gateway that read its JSON APIs."""
