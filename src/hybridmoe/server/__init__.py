"""An OpenAI-compatible HTTP server over the engine (`hybridmoe serve`): `app.create_app` builds
the FastAPI app, `run.serve` runs it under uvicorn. Kept empty so `server.config` imports
without the web stack."""
