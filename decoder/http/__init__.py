"""OpenAI-compatible HTTP in front of a Decoder service (a router's, or a decoder's).

`openai` translates OpenAI's requests, responses and errors (pure); `app` is the ASGI
application: it authenticates, bounds and reads each request, and forwards it as a
Decoder Generate call to the service it fronts, over a local socket, with the caller's
own token; `server` runs the application under uvicorn, with TLS when the service has it.
"""
