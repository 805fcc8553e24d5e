"""What an operator sees: Prometheus metrics, the request log, the recovery log, the live feed's memory
(`recorder`) and the dashboard."""
