"""A store served over HTTP to other processes: :class:`~lightning_nb.store.http.server.StoreServer` (``server.py``,
its request bodies ``bodies.py``, its hot Starlette routes ``hot.py`` and its answers ``responses.py``) and
:class:`~lightning_nb.store.http.client.StoreClient` (``client.py`` over libcurl, ``curl.py``). Nothing is imported
here: ``lightning_nb.store`` exports both classes."""
