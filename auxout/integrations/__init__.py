"""Engine integrations: each subpackage binds auxout's connectors to one inference engine."""
