"""HTTP as both servers speak it: the hardened server pieces (:mod:`~ddm.serving.http.server`,
:mod:`~ddm.serving.http.connections`, :mod:`~ddm.serving.http.auth`), the router's one
keep-alive client (:mod:`~ddm.serving.http.client`), the one bounded small-JSON read
(:mod:`~ddm.serving.http.fetch`) and hybrid polling (:mod:`~ddm.serving.http.polling`)."""
