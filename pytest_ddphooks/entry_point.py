"""The ``pytest11`` entry point ``ddphooks``.

It only names the real plugin module, so that a conftest may also write
``pytest_plugins = ["pytest_ddphooks.plugin"]``: pytest then finds that module registered
already and loading it both ways is harmless. ``-p no:ddphooks`` blocks this shim and with
it the plugin.
"""

pytest_plugins = ["pytest_ddphooks.plugin"]
