"""The pipeline runtime: schedules as data, stages as lists of layers, the activation store."""
