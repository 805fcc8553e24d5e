"""The gateway's routes: each protocol's folder (routes, wire models, serving logic) and one module per
endpoint family of the trainer's and operator's API."""
