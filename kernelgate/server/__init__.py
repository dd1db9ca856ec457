"""OpenAI-compatible HTTP server over the async engine (`kernelgate serve`; the app is
`server.app.create_app`). Nothing is imported here: `kernelgate run` uses the detokenizer
without loading the web stack."""
