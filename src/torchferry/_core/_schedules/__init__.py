"""Layer 5, when: step hooks, layer-wise reload, offload during forward, swap's release
schedule, unchanged storages and their hash. Imports only the layers below it."""
