"""One module per kvcli command (or family of commands); each exports COMMANDS, a list of click commands."""
