"""One module per measured path; each benchmark is a function of the Node it runs on."""
