{{WIDE}} = arith.extsi {{BITS}} : i16 to i32
{{C16}} = arith.constant 16 : i32
{{UP}} = arith.shli {{WIDE}}, {{C16}} : i32
{{WF}} = arith.bitcast {{UP}} : i32 to f32
