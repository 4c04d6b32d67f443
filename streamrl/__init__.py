"""streamrl: the application package. The config root, the command line, the supervisor, the dashboard."""
