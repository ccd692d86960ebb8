{{QF}} = arith.sitofp {{QV}} : {{QE}} to f32
{{W}} = arith.mulf {{QF}}, {{SC}} : f32
{{P}} = arith.mulf {{A}}, {{W}} : f32
{{SUM}} = arith.addf {{ACC}}, {{P}} : f32
