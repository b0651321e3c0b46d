"""The stack's monitoring, written like a monitoring mixin: one config (config.py) holds every
threshold, window, selector and objective; rules.py and dashboards.py generate the Prometheus rules
and the Grafana dashboards from it (generate.py writes and checks the committed files);
panel_queries.py runs the dashboards' queries as Grafana would; render_panels.py draws them;
promql_checks.py checks every expression against what Prometheus 3 changed.
"""
