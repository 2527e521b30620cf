pytest_plugins = ["amprl.netsim.pytest_plugin"]
