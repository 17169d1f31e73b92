"""The router's API: the server and its routes, request and answer schemas, who a request
comes from, ``/v1/info``, previews, the web page, and ``ddm sample --router``'s client."""
