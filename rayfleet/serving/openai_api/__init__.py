"""The openai_api room: the OpenAI-compatible HTTP face of the built-in engine (top of the serving ladder).

``app`` is the FastAPI app over a ``generation_service.GenerationService`` (a protocol of this
room; it never imports ``deploy``); ``generation``, ``text_stream``, ``tokenization``,
``schemas``, ``responses`` and ``errors`` are its parts. ``serve_app`` (the Serve ingress and
application) and ``in_process`` (the same stack in one process) wire the request path from
``deploy`` into it.
"""
