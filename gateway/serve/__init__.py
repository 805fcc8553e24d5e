"""Serving the app: uvicorn with the limits a production proxy has (`server`), and N processes on one
port (`processes`)."""
