hal.executable.source private @{{NAME}} <objects = <{{{OBJECTS}}}>> {
    hal.executable.export public @{{NAME}} ordinal(0) layout({{LAYOUT}}) count(%device: !hal.device, %rows: index) -> (index, index, index) {
      %x = affine.apply affine_map<()[s0] -> (s0 ceildiv {{ROWS}})>()[%rows]
      %c1 = arith.constant 1 : index
      hal.return %x, %c1, %c1 : index, index, index
    }
    builtin.module {
      func.func private @q4_matvec_workgroup({{MEMREFS}}, index, index, index) attributes {hal.import.static}
      func.func @{{NAME}}() {
        %c0 = arith.constant 0 : index
        %inner = arith.constant {{INNER}} : index
        %per = arith.constant {{ROWS}} : index
        %out = arith.constant {{OUT}} : index
        %wg = hal.interface.workgroup.id[0] : index
        %row0 = arith.muli %wg, %per : index
        %left = arith.subi %out, %row0 : index
        %n = arith.minui %left, %per : index
        %x = hal.interface.binding.subspan layout({{LAYOUT}}) binding(0) alignment(64) offset(%c0) flags(ReadOnly) : memref<{{INNER}}xf32>
        %q = hal.interface.binding.subspan layout({{LAYOUT}}) binding(1) alignment(64) offset(%c0) flags(ReadOnly) : memref<{{BYTES}}xi8>
        %s = hal.interface.binding.subspan layout({{LAYOUT}}) binding(2) alignment(64) offset(%c0) flags(ReadOnly) : memref<{{SCALES}}xf16>
        %o = hal.interface.binding.subspan layout({{LAYOUT}}) binding(3) alignment(64) offset(%c0) : memref<{{OUT}}xf32>
        func.call @q4_matvec_workgroup(%x, %q, %s, %o, %inner, %row0, %n) : ({{MEMREFS}}, index, index, index) -> ()
        return
      }
    }
  }
