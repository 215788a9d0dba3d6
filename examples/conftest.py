# The plugin loads through its entry point; nothing is needed here. To be explicit instead:
#     pytest_plugins = ["pytest_ddphooks.plugin"]
