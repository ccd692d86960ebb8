    {{NAME}}:2 = stablehlo.reduce({{X}} init: {{NINF}}), ({{IDX}} init: {{ZERO}}) across dimensions = [{{DIM}}] : ({{X_TY}}, {{IDX_TY}}, tensor<f32>, tensor<i32>) -> ({{OUT_F}}, {{OUT_I}})
      reducer(%a: tensor<f32>, %b: tensor<f32>) (%ai: tensor<i32>, %bi: tensor<i32>) {
        %gt = stablehlo.compare GT, %a, %b : (tensor<f32>, tensor<f32>) -> tensor<i1>
        %eq = stablehlo.compare EQ, %a, %b : (tensor<f32>, tensor<f32>) -> tensor<i1>
        %lt = stablehlo.compare LT, %ai, %bi : (tensor<i32>, tensor<i32>) -> tensor<i1>
        %tie = stablehlo.and %eq, %lt : tensor<i1>
        %pick = stablehlo.or %gt, %tie : tensor<i1>
        %x = stablehlo.select %pick, %a, %b : tensor<i1>, tensor<f32>
        %y = stablehlo.select %pick, %ai, %bi : tensor<i1>, tensor<i32>
        stablehlo.return %x, %y : tensor<f32>, tensor<i32>
      }
