#hal.executable.target<"llvm-cpu", "{{FORMAT}}"> = [#hal.executable.object<{path = "{{OBJECT}}"}>]
